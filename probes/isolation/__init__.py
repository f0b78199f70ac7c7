"""Isolation probes: packed documents that must not see each other, and outputs that must
not depend on the batch they are computed in. See docs/isolation.md."""
from trainprobes.isolation.batch import batch_invariance
from trainprobes.isolation.documents import documents
from trainprobes.isolation.packing import Document, Packing

__all__ = ["documents", "batch_invariance", "Packing", "Document"]
