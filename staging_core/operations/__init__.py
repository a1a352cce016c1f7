"""push and pull: the pipeline (plan, open, strategy, finish) and the policy above the transports."""
