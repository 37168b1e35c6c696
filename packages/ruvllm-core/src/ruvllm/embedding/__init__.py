"""Embedding and cross-encoder models: sentence-transformers' pipeline read from the model's folder
(:mod:`~ruvllm.embedding.pipeline`), its pooling, Dense, Normalize and classifier heads
(:mod:`~ruvllm.embedding.heads`), and :class:`EmbeddingModel` over a backend's encoder pass."""

from ruvllm.embedding.model import EmbeddingModel, Encoded, is_encoder_folder, load_embedding_model
from ruvllm.embedding.pipeline import Pipeline, read_pipeline

__all__ = ["EmbeddingModel", "Encoded", "Pipeline", "is_encoder_folder", "load_embedding_model", "read_pipeline"]
