"""The commit boundary: claim, execute, record, replay, reconcile, compensate."""
