import os
import sys

from scripts.bench_gpu import main

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.exit(main())
