import sys
from pathlib import Path

# importable without installation, as on the GPU host (PYTHONPATH=contrib/foretell-demo-train)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
