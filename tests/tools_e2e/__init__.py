"""Test-only tool modules that end-to-end policies reference as `tools_e2e.<module>:<function>`."""
