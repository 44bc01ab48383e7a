"""gradline's MLflow model, logged from code (MLflow's models-from-code).

MLflow runs this file when it loads a gradline model (`mlflow.pyfunc.load_model`), with
the shipped `training` package on the path; gradline itself never imports it. The model
in the registry is then this source file, the model folder (weights read with
`weights_only=True`, JSON, the tokenizer's JSON) and the code: no pickled Python object
that would run on load.
"""

from pathlib import Path

import mlflow.pyfunc
from mlflow.models import set_model

from training.mlops.serving import MODEL_DIR_ARTIFACT, Predictor


class GradlineModel(mlflow.pyfunc.PythonModel):
    # The input is a table, an image array or prompts, described by an explicit
    # signature: MLflow's switch that stops it asking for predict's type hints (its own
    # chat models set it too). Were it gone, only a warning would come back.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        self.predictor = Predictor(Path(context.artifacts[MODEL_DIR_ARTIFACT]))

    def predict(self, context, model_input, params=None):
        return self.predictor.predict(model_input, params)


set_model(GradlineModel())
