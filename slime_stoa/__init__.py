"""stoa's trainer side and shared protocol.

The protocol modules (`store`, `layout`, `records`, `validate`, `pulse`) import neither torch,
mlx nor slime, so a Mac worker uses them too.
"""

__version__ = "0.1.0"
