"""The trainer's own copies of what it signed: `slime_stoa.protocol.kept` (the publisher in
`protocol.pulse` keeps its pointers and manifests there too, and the protocol package imports
nothing of the trainer's), named here for the consumer's modules."""

from slime_stoa.protocol.kept import TrainerCopies

__all__ = ["TrainerCopies"]
