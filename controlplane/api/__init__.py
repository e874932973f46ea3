"""The REST API (`/api/v1`): one router module per resource."""
