"""The dataset check under the path the project's guide gives (an entry point, not a library module).

    python utils/validate_dataset.py --path path/to/your/dataset [--config X.yaml] ...

It runs ``validate_dataset.py`` at the repository root, beside the other entry scripts, with the
same arguments, output and exit code. The check itself lives in ``image_datasets.checks``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    # Run as a file, Python puts utils/ first on the import path: the repository root instead.
    sys.path[0] = str(ROOT)
    from validate_dataset import main

    sys.exit(main())
