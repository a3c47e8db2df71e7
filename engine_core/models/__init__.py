"""Model implementations written against the paged attention interface."""
