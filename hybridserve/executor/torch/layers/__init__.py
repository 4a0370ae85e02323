"""Building blocks shared by the model implementations (norms, rotary embeddings, MLPs)."""
