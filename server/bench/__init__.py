"""`commitgate bench`: experiments and overhead measurements through real server processes."""
