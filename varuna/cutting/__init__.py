"""Cutting a model into segments: ``CutPoint``, the dry run and stage materialisation, the tracer that
refuses hidden cross-stage dependencies, and automatic / by-name cut-points."""
