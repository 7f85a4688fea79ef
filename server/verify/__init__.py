"""`commitgate verify` and the pytest plugin: prove a tool ready against a real server."""
