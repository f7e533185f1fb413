"""The ipw command line: a thin shell around pure functions. ``IpwError`` maps to its exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="ipw measures the intelligence efficiency of LLM inference: correct answers per joule (IPJ), "
    "accuracy per watt (IPW) and routing coverage, on your own hardware.",
)


def _console():
    from rich.console import Console

    return Console(stderr=True)


@app.command()
def run(
    config: Optional[Path] = typer.Argument(
        None, help="Run config (TOML) from configs/. Without one, the embedded default runs: 24 bundled "
        "queries through SmolLM2-135M-Instruct (chat) and Gemma-3-270M (few-shot)."),
    dataset: Optional[str] = typer.Option(
        None, "--dataset", "-d", help="Query set: a bundled name (ipw-core, ipw-core-default) or a .jsonl/.csv/"
        ".parquet file with id, prompt, answer[, choices, category, scorer]. Overrides the config."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", help="Run only the first N queries (0 = all)."),
    backend: Optional[List[str]] = typer.Option(
        None, "--backend", "-b", help="Backend to run: a name from the config, or KIND:MODEL such as "
        "llama-cpp:smollm2-135m or llama-cpp:/path/model.gguf. Repeat for several."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder that receives the run folder (default results/)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (greedy decoding ignores it)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Times each query runs per backend."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Unmeasured warm-up queries per backend."),
    idle_s: Optional[float] = typer.Option(None, "--idle-s", help="Seconds of idle baseline per backend (model loaded)."),
    resume: Optional[Path] = typer.Option(
        None, "--resume", help="Continue an interrupted run folder: queries already recorded are kept, the "
        "rest run with the run's own config (give no other option)."),
) -> None:
    """Run a query set through backends, measuring the energy of every query, and write a run folder."""
    from ipw.commands import run_command

    raise typer.Exit(run_command(config, dataset=dataset, limit=limit, backends=backend, out=out, seed=seed,
                                 repeats=repeats, warmup=warmup, idle_s=idle_s, resume=resume))


@app.command("list")
def list_() -> None:
    """List backend kinds, bundled models and datasets, and the sensors this machine offers."""
    from ipw.commands import list_command

    raise typer.Exit(list_command())


def main(argv: list[str] | None = None) -> int:
    from ipw.errors import IpwError

    try:
        result = app(args=argv, prog_name="ipw", standalone_mode=False)
    except IpwError as exc:
        _console().print(f"[bold red]error:[/] {exc.message}", highlight=False, markup=True, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        _console().print("interrupted")
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # click's usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return 2
        if isinstance(exc, click.exceptions.Abort):
            return 130
        raise
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
