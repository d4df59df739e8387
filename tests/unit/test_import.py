import subprocess
import sys


def test_import_does_not_pull_torch_or_vllm() -> None:
    code = (
        "import sys, langgraph_kvcache as m\n"
        "from langgraph_kvcache import SQLAlchemySaver, AsyncSQLAlchemySaver\n"
        "bad = [n for n in ('torch', 'vllm') if n in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
