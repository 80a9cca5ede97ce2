"""index_builder: corpus -> sharded FAISS kNN-LM datastore with a manifest."""
