"""`commitgate demo` and the sandbox harness it shares with the benchmark."""
