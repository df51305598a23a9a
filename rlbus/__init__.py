"""rlbus: reinforcement fine-tuning of language models as an event-driven system around a message broker.

One import name over the repository's folders, in layers; a module imports only from layers below it
(`tests/test_layers.py` checks this with import-linter):

    rlbus.cli, rlbus.launcher, rlbus.logview, rlbus.timeline   entry points and tools    rlbus/
    rlbus.broker  rlbus.explorer  rlbus.trainer  rlbus.reward   the processes             broker/ explorer/ ...
    rlbus.weights                                               models and weight sync    weights/
    rlbus.common                                                the contract              common/

The contract is what every process shares: the wire protocol, the config, the broker client, the
trajectory type and logging. It imports neither torch nor vLLM.
"""

__version__ = "0.1.0"

import os as _os

# pyproject.toml maps rlbus.broker onto the folder broker/ (and so on) for installs. Run from a source
# checkout, `python -m rlbus.cli` finds this folder first, so the checkout's root joins the search path:
# rlbus.broker is then the broker/ beside this folder, however rlbus was installed (or if it was not).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_root, *f)) for f in (("pyproject.toml",), ("broker", "__init__.py"))):
    __path__.append(_root)
