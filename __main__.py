"""Not part of the package: ``python -m agentspec`` run from the parent of this checkout.

Python then imports this checkout folder (no ``__init__.py`` here) as a
namespace package named ``agentspec`` instead of the installed package, and
finds this file as ``agentspec.__main__``.  It says so and how to fix it,
instead of letting the command fail with an obscure ImportError.  The real
command line is ``agentspec/__main__.py``.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    sys.stderr.write(
        f"agentspec: error: 'agentspec' resolved to the folder {_HERE} (a source checkout), "
        "not to the installed package: Python imports a folder named agentspec in the current "
        "directory (or on PYTHONPATH) as a namespace package. Run agentspec from another "
        f"directory (for instance cd {_HERE}), or rename that folder; install the package "
        f"with: python -m pip install -e {_HERE}\n"
    )
    sys.exit(2)
