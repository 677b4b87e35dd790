"""What several test modules share: the framework adapters' facts, and running an example as a user does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from infokv_rag import CompressionConfig

ROOT = Path(__file__).resolve().parents[1]

# The framework adapters (LangChain, LlamaIndex) ----------------------------------------------------

FACT_PAGES = [
    (
        "Service Agreement between Orion Logistics Ltd and Blue Harbor Foods.\n"
        "1. Term. This agreement starts on 1 March 2024 and runs for two years."
    ),
    (
        "2. Contact. The account manager is Maria Lindqvist, phone 555-0142.\n"
        "3. Notice. Either party may terminate this agreement with ninety days written notice."
    ),
    "4. Payment. The customer pays 12,500 EUR per month.\n5. Law. This agreement is governed by the laws of Sweden.",
]
# The fact checks test the adapters, not the compression: the tiny model reads these facts from a full
# cache, while whether a compressed one keeps them moves with every scorer change. The compressed path is
# covered by the standard suites (default config), by the engine-equality tests and the default-model test.
COMPRESSION = CompressionConfig(method="full")
COMPRESSED = CompressionConfig(method="infokv", keep=0.5)
QUESTION = "Question: {question}\nAnswer concisely, using only the document above."


def run_example(script: str, document: Path, question: str) -> list[str]:
    """stdout lines of `python examples/<script>` on the tiny model over `document` (full cache, 12 tokens)."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / script),
            "--model",
            "tiny",
            "--document",
            str(document),
            "--method",
            "full",
            "--max-tokens",
            "12",
            "--question",
            question,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()
