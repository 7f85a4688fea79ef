"""Facts every layer shares: classes, states, codes, records, the tool-facing context and outcomes."""
