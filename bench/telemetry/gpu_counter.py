"""The reference for docs/GPU.md: the NVML energy counter of every GPU, read back to back by a process of
its own (not ipw), on the same monotonic clock, until SIGTERM or SIGINT.

    python bench/telemetry/gpu_counter.py counter.csv &  ...  kill %1

Each row: the monotonic times just before and after the read, the GPU index and the counter (mJ).
A read costs ~3-4 ms on an H200, so the counter is read a few hundred times a second; it steps about
every 100 ms (docs/ARCHITECTURE.md, 'Energy method').  ``bench/telemetry/gpu_figures.py`` interpolates it at ipw's query windows.

Output: the CSV named (the reference counter of a GPU session), read by bench/telemetry/gpu_figures.py and
    bench/serving/serving_validate.py; kept in the session's evidence folder (bench/evidence/telemetry/gpu/,
    bench/evidence/serving/).
"""

from __future__ import annotations

import signal
import sys
import time


def main(path: str) -> int:
    import pynvml

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    with open(path, "w", encoding="utf-8") as out:
        out.write("t_before_s,t_after_s,gpu,energy_mj\n")
        while not stop:
            for i, handle in enumerate(handles):
                before = time.monotonic()
                energy = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                out.write(f"{before:.6f},{time.monotonic():.6f},{i},{energy}\n")
            time.sleep(0.001)
    pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
