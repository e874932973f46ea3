"""What operators deploy next to a fleet: Prometheus rules and config, Grafana dashboards."""
