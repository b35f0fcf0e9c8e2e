"""indextts-prepare: from audio and transcripts to the manifests and feature files the trainer reads
(docs/data_preparation.md). backend.py is the seam between this pipeline and a model family's feature code."""
