"""Node-key backends."""
