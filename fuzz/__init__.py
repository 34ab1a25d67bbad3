"""HTTP-level property-based fuzzing of a real ``better-compute serve`` (``make fuzz``)."""
