"""The training methods by the name a stage's `method` gives (vlft.training.methods: what the loop
asks of each); the loop builds the one its stage names from here, and names none itself."""

from __future__ import annotations

from vlft.training.dpo import PreferenceOptimization
from vlft.training.grpo import GroupRelativePolicyOptimization
from vlft.training.methods import SupervisedFineTuning

METHODS = {
    method.name: method for method in (SupervisedFineTuning, PreferenceOptimization, GroupRelativePolicyOptimization)
}
