"""What type checkers and editors see of `asyncps` (the package loads the API lazily: asyncps/__init__.py)."""

from asyncps.ml.sparse import HashEmbedding as HashEmbedding
from asyncps.tools.api import History as History
from asyncps.tools.api import RunDiverged as RunDiverged
from asyncps.tools.api import TrainingFailed as TrainingFailed
from asyncps.tools.api import TrainResult as TrainResult
from asyncps.tools.api import train as train

__version__: str
__all__ = ["HashEmbedding", "History", "RunDiverged", "TrainResult", "TrainingFailed", "__version__", "train"]
