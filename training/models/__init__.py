"""Models: built-ins (mlp, cnn, gpt) in a registry, or the user's own by `model.target`.

Modules, each with one job:
    options      the `model` section: the built-ins' keys and the data they take (no torch)
    registry     build_model, check_buildable, context_length: the one place models
                 are built, sized by the task's objective
    standardize  tables standardized and outputs in the label's units inside the model
    mlp, cnn, gpt the built-in architectures
    user         importing and calling the user's factory
    folder       ModelSpec and the saved model folder (save_model_dir, load_model_dir)

Model code holds no distributed code: parallel wrappers are applied to a built model
(training.engine.parallelize).
"""
