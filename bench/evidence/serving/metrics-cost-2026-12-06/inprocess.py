"""The per-record CPU of the two exports, in process (run from the repository root): Metrics.observe, and
OtelExport.add with a batch span processor and a metric reader exporting over OTLP/HTTP to a receiver on
127.0.0.1 (tests/test_otel.py's Collector); then one Prometheus exposition."""

import sys
import time

sys.path.insert(0, "tests")
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from test_otel import Collector, _record

from ipw.export import otel, prometheus

collector = Collector()
records = [_record(query_id=f"q{i}") for i in range(5000)]
metrics = prometheus.Metrics(operation=True)
t = time.process_time()
for r in records:
    metrics.observe(r, "m")
print("Metrics.observe, us per record", (time.process_time() - t) / len(records) * 1e6)
t = time.process_time()
for _ in range(50):
    metrics.exposition()
print("Metrics.exposition, ms", (time.process_time() - t) / 50 * 1e3)
export = otel.OtelExport("serve", print, operation=True, reader=PeriodicExportingMetricReader(
    OTLPMetricExporter(endpoint=collector.url + "/v1/metrics"), 1000),
    processor=BatchSpanProcessor(OTLPSpanExporter(endpoint=collector.url + "/v1/traces")))
t = time.process_time()
for r in records:
    export.add(r, "m")
print("OtelExport.add, us per record (the process's CPU: the SDK's threads too)",
      (time.process_time() - t) / len(records) * 1e6)
t = time.process_time()
export.close()
print("close (the last batches), ms", (time.process_time() - t) * 1e3, "spans received", len(collector.spans()))
