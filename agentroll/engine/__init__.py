"""The built-in inference engine: pure scheduling and KV bookkeeping, plus the torch runner."""
