"""slime-rl: durable reinforcement-learning post-training for language models.

Plugin authors import `hookimpl` from here; see `slime.hookspecs` for the contract.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("slime")

__all__ = ["hookimpl", "__version__"]
