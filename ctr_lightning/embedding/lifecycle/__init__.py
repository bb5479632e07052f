"""What rows a table keeps: admission of new ids (a sighting sketch, a per-group gate)."""
