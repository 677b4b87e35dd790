"""Framework adapters (thin): `infokv_rag.integrations.langchain` and `infokv_rag.integrations.llama_index`.

Each needs its extra: `pip install 'infokv-rag[langchain]'` or `'infokv-rag[llamaindex]'`.
"""
