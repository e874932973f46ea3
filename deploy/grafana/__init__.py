"""The Grafana dashboard, generated from code (`python -m deploy.grafana`)."""
