"""Exports of ipw's energy into the tools operators already run: Prometheus, OpenTelemetry, MLflow."""
