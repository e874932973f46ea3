"""Widgets shared by the views: the stale-data banner, tables with a filter, bars and the status
line."""
