"""The Grafana dashboard, generated from code (`python -m monitoring.grafana`)."""
