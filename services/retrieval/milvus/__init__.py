"""The Milvus backend of the retrieval service (``TANDEM_RETRIEVAL_BACKEND=milvus``)."""
