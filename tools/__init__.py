"""Tools that work on kangaroo (corpus, training, analysis); they register no hooks."""
