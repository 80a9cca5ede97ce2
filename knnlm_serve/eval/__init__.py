"""knnlm-eval: perplexity of held-out text through the serving path: text -> score -> sweep -> report."""
