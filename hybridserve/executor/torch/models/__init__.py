"""Model implementations. Each module registers its classes with `register_model`."""
