"""The semantic cache: embeddings, ANN index, meaning-change guard."""
