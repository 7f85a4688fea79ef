"""The policy file: its models, its rules and how it is loaded."""
