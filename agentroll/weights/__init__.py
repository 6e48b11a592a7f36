"""Weight sync: full and delta updates, checksums, apply with rollback, transports."""
