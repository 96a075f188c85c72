"""CPU stand-in for torchvision (see ../README.md): importable, and unusable."""

import _slime_cpu_standin

__version__ = "0.0.0+slime.cpu.standin"

_slime_cpu_standin.install(__name__)
__getattr__ = _slime_cpu_standin.StandinModule.__getattr__.__get__(_slime_cpu_standin.StandinModule(__name__))
