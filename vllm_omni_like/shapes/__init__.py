"""The procedural shapes world the embedded models are trained on, and its checker."""
