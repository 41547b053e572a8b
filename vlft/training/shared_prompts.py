"""A reward stage's prompts computed once a step: the rollout's prefill is the update's forward over them.

With one update a rollout (`num_iterations: 1`), GRPO learns a step's sampled answers under the
very weights that drew them. TRL, ms-swift and verl compute each prompt twice a step: the
rollout's prefill, without gradients, then the update's forward over prompt and answer. Here the
rollout's prefill runs as the update's forward would (the adapter's float32 weights under
autocast, with gradients, through a compiled decoder layer on a GPU), and each layer's keys and
values are kept (`PromptPass.prefill`, the engine's prefill). The decode steps read those keys and
values, detached, from the engine's cache. The update then computes only the answers' tokens
(`PromptPass.answer_logps`): each attends to its prompt's kept keys and values and causally to
itself (vlft.forward.packing.packed_attention's `packed_prompt_keys`; the prefix its prompt shares
with the answers beside it is read once for all of them, vlft.forward.prefix_attention), and its
first token is scored from its prompt's last hidden state. One backward pass goes through both forwards.

The log-probabilities and gradients are those of the full forward over prompt and answer
(tests/training/test_grpo.py, float64, against TRL's loss over separate sequences), wherever the rollout and
the update compute the same prompts: one update a rollout, no LoRA dropout (a prefill in training
mode would draw the masks the answers are then sampled under), and no activation checkpointing (its
recomputation would not keep the prompts' keys), on a model of attention layers alone (a hybrid
model's linear-attention layers would hand each answer its prompt's recurrent state and
convolution window, which the kept prompts do not hold yet). `prompts_once_unless` says which of
those a stage lacks. With several processes each keeps the prompts of its own share of the step, which it then
learns (vlft.training.grpo).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch

from vlft.generation.kv_cache import prompt_positions
from vlft.generation.runner import Prefilled, layer_calls, prefill
from vlft.modeling import adapter_autocast, is_hybrid_model, language_model, unwrapped
from vlft.forward.batching import host_to_device
from vlft.forward.loss import token_logps
from vlft.training.step_evals import swapped_data


def prompts_once_unless(model, settings) -> str | None:
    """Why a GRPO stage computes its prompts twice a step (once a step where None)."""
    dropout = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if settings.num_iterations != 1:
        return f"num_iterations {settings.num_iterations}: a rollout is learned by later weights too"
    if settings.filter_groups:
        return "filter_groups: a step learns some of the questions its rollout prefilled, and others'"
    if dropout:
        return f"the adapter's LoRA dropout {max(dropout)}: the answers are drawn without it"
    if getattr(language_model(unwrapped(model)), "gradient_checkpointing", False):
        return "activation checkpointing recomputes the prompts' forward"
    if is_hybrid_model(model):
        return "the model's linear-attention layers: the prompts kept hold their attention layers' keys alone"
    return None


# The most autograd nodes a step's answers' forward makes for each module of the language model
# (the prompts' are numbered above them, `_numbered_apart`): the test models' made under two.
ANSWERS_NODES_A_MODULE = 8


@dataclass
class KeptLayer:
    """One layer's keys and values of a prefill, as its attention computed them (normed, rotated):
    handed to the layer as its cache, they stay with their gradients."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        return key_states, value_states


@dataclass
class KeptKeys:
    """A prefill's keys and values, a KeptLayer a layer (what the engine's cache copies from)."""

    layers: list[KeptLayer] = field(default_factory=list)


def _layer_keeping_keys(layer, cache_name: str, *args, **kwargs):
    """A decoder layer's own call, its cache a KeptLayer of its own: its output, keys and values.
    Compiled once, every layer runs it with its own weights (the KeptLayer is made inside, so the
    compiled graph returns its tensors rather than storing them into an object of the caller's)."""
    kept = KeptLayer()
    kwargs[cache_name] = kept
    return layer._call_impl(*args, **kwargs), kept.keys, kept.values


def _layer_after_prompts(layer, keys, values, *args, **kwargs):
    """A decoder layer's own call over answer tokens that attend to its kept prompt `keys` and `values`."""
    return layer._call_impl(*args, packed_prompt_keys=keys, packed_prompt_values=values, **kwargs)


@dataclass
class _Asked:
    """Where a request's prompt lies: its prefill, its place among that prefill's requests, and the
    text position of its answer's first token."""

    prefill: int
    place: int
    first_position: int


class PromptPass:
    """The prompts of one rollout, prefilled with gradients, until its answers' update has used them."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, compile: bool):
        self.model, self.text = model, language_model(unwrapped(model))
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.forward_context = adapter_autocast(model, device, dtype)
        # One compiled decoder layer, which every layer runs, for each forward. The answers' forward
        # is short (some hundreds of tokens): its host's work outweighs its kernels, which eagerly
        # made it slower still, and compiled whole (one graph of every layer) it did not finish
        # compiling (benchmarks/README.md, GRPO).
        compiled = partial(torch.compile, dynamic=True) if compile else (lambda f: f)
        self.keeping, self.after = compiled(_layer_keeping_keys), compiled(_layer_after_prompts)
        # What the answers' forward numbers its nodes below (`_numbered_apart`).
        self.answers_nodes = ANSWERS_NODES_A_MODULE * sum(1 for _ in self.text.modules())
        self.clear()

    def clear(self) -> None:
        """Nothing held (the backward pass keeps what it needs of the last rollout's forward)."""
        self.prefills: list[Prefilled] = []
        self.asked: dict[int, _Asked] = {}
        self.own: list[torch.Tensor] | None = None

    @contextmanager
    def rollout(self):
        """Around the engine's run: the adapter's own float32 weights noted, for the prefills, before
        the run puts the model's dtype's in their place for the decode steps."""
        self.clear()
        self.own = [p.data for p in self.trainable]
        _numbered_from(self.answers_nodes)  # the prefills' nodes outnumber the answers' (`_numbered_apart`)
        yield

    def prefill(self, model, group: list, sampler) -> Prefilled:
        """The engine's prefill of `group`, computed as the training's forward, its keys kept."""
        kept = [KeptLayer() for _ in self.text.layers]
        calls = [partial(self._keeping_call, kept, i) for i in range(len(kept))]
        with swapped_data(self.trainable, self.own), torch.enable_grad(), self.forward_context:
            with _training(model), layer_calls(self.text.layers, calls):
                prefilled = prefill(model, group, sampler)
        prefilled.cache = KeptKeys(kept)
        for place, request in enumerate(group):
            first = int(request.positions[..., : request.prompt].max()) + 1
            self.asked[request.key] = _Asked(len(self.prefills), place, first)
        self.prefills.append(prefilled)
        return prefilled

    def _keeping_call(self, kept: list[KeptLayer], index: int, *args, **kwargs):
        name = "cache" if "cache" in kwargs else "past_key_values"
        output, kept[index].keys, kept[index].values = self.keeping(self.text.layers[index], name, *args, **kwargs)
        return output

    def answer_logps(self, answers: list[tuple[int, list[int]]]) -> torch.Tensor:
        """The token log-probabilities of `answers` ((the request's key, its tokens), each drawn
        after its prompt was prefilled here), answer after answer, with gradients through both
        forwards; everything held is let go (the backward pass keeps what it needs)."""
        offsets, start = [], 0  # where each prefill's positions begin among all prefills' keys
        for prefilled in self.prefills:
            offsets.append(start)
            start += prefilled.cache.layers[0].keys.shape[2]
        device = self.prefills[0].last_hidden.device
        inputs, positions, prompts, shared = [], [], [], []
        firsts, order, row = [], [], 0
        for key, tokens in answers:
            asked = self.asked[key]
            prefilled = self.prefills[asked.prefill]
            firsts.append(prefilled.last_hidden[asked.place])
            own = len(tokens) - 1  # the answer's tokens before its last: each predicts the next
            order.append((len(firsts) - 1, row, own))
            if not own:
                continue
            prompts.append(prompt_positions(prefilled.spans[asked.place]) + offsets[asked.prefill])
            shared.append(prefilled.shared[asked.place])
            inputs.append(torch.tensor(tokens[:-1]))
            positions.append(torch.arange(own) + asked.first_position)
            row += own
        answer_hidden = None
        if inputs:
            lengths = [len(i) for i in inputs]
            keys = _after_prompts(prompts, shared, lengths) if all(shared) else _gathered(prompts, lengths, start)
            answer_hidden = self._answer_hidden(inputs, positions, keys, device)
        # Each answer's rows in order: its prompt's last hidden state, then its own tokens'.
        first_hidden = torch.stack(firsts)
        hidden = torch.cat([first_hidden, answer_hidden]) if answer_hidden is not None else first_hidden
        rows = torch.cat(
            [torch.cat([torch.tensor([n]), torch.arange(at, at + own) + len(firsts)]) for n, at, own in order]
        )
        targets = host_to_device(torch.tensor([t for _, tokens in answers for t in tokens]), device)
        self.clear()
        return token_logps(
            hidden.index_select(0, host_to_device(rows, device)), unwrapped(self.model).lm_head.weight, targets
        )

    def _answer_hidden(self, inputs, positions, keys: dict, device):
        """The last hidden states of every answer token but each answer's last, in one packed row,
        its attention's inputs `keys` (on the host)."""
        calls = []
        for i, layer in enumerate(self.text.layers):
            prompt_keys = _joined([p.cache.layers[i].keys for p in self.prefills])
            prompt_values = _joined([p.cache.layers[i].values for p in self.prefills])
            calls.append(partial(self.after, layer, prompt_keys, prompt_values))
        text_positions = host_to_device(torch.cat(positions), device)
        lengths = [len(i) for i in inputs]
        attention = {k: host_to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in keys.items()}

        def forward():
            with layer_calls(self.text.layers, calls):
                return self.text(
                    input_ids=host_to_device(torch.cat(inputs)[None], device),
                    position_ids=text_positions.view(1, 1, -1).expand(3, 1, -1),  # text: all three at one position
                    use_cache=False,
                    packed_cu_seqlens=_cumulative(lengths, device),
                    packed_max_seqlen=max(lengths),
                    **attention,
                ).last_hidden_state[0]

        return _numbered_apart(forward, device, below=self.answers_nodes)


def _numbered_from(least: int) -> None:
    """The calling thread's autograd counter (`_numbered_apart`) at `least` or above: nodes that
    make nothing, once a process (a fraction of a second)."""
    missing = least - torch._C._autograd._get_sequence_nr()
    if missing > 0:
        with torch.enable_grad():
            counted = torch.zeros((), requires_grad=True)
            for _ in range(missing):
                counted.neg()


def _numbered_apart(forward, device: torch.device, below: int | None = None):
    """`forward()` run in a thread of its own, under the caller's grad mode, autocast and device,
    so that the backward pass interleaves its layers with the prompts' (it changes no result) and
    takes the step's nodes in an order of the step's own, whatever the process did before it.
    `below`: the most nodes it may make (more is an error: the order would not be the step's own).

    Autograd numbers the nodes a thread makes in the order it makes them (a counter of the
    thread's own), and its backward pass runs the ready node with the highest number first. Made
    on the main thread after the rollout's prefill, the answers' layers outnumbered every prompt
    layer, so the backward pass ran all of the answers' layers, whose host's work outweighs their
    kernels (a few tokens a layer: the device idle), before the first prompt layer (thousands of
    tokens: the device busy). Numbered from zero in a thread of their own, they come below: each
    prompt layer runs as soon as its answers' layer has given it its keys' gradients, and the host
    launches the next answers' layer while the device works on it.

    They come below only where the main thread's counter, which grows with everything the process
    did, is past them when the prompts are prefilled; early in a process it was not (a stage
    resumed in a new process), the backward pass took some nodes in another order, and where a
    node's gradient is the sum of three or more parts, another order rounds it differently: the
    resumed stage trained to an adapter a few float32 roundings from an uninterrupted one's. So
    every rollout first takes the main thread's counter to `below` (`_numbered_from`)."""
    grad, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled(device.type)
    autocast_dtype = torch.get_autocast_dtype(device.type)
    outcome: dict = {}

    def run():
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad), torch.autocast(device.type, autocast_dtype, enabled=autocast):
                outcome["value"] = forward()
            outcome["nodes"] = torch._C._autograd._get_sequence_nr()
        except BaseException as error:  # raised again in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="answers' forward")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if below is not None and outcome["nodes"] > below:
        raise RuntimeError(
            f"the answers' forward made {outcome['nodes']} autograd nodes, more than the {below} the prompts' "
            "are numbered above (vlft.training.shared_prompts.ANSWERS_NODES_A_MODULE is too low for this model)"
        )
    return outcome["value"]


def _gathered(prompts: list[torch.Tensor], lengths: list[int], kept: int) -> dict:
    """Each answer's keys gathered whole: its prompt's kept positions (`prompts`, among the `kept`
    prompt keys), then its own tokens' (packed_attention's `packed_key_index`)."""
    index, row = [], 0
    for prompt, length in zip(prompts, lengths):
        index += [prompt, torch.arange(row, row + length) + kept]
        row += length
    key_lengths = [len(p) + length for p, length in zip(prompts, lengths)]
    return {
        "packed_key_index": torch.cat(index),
        "packed_cu_seqlens_k": _cumulative(key_lengths, "cpu"),
        "packed_max_seqlen_k": max(key_lengths),
    }


def _after_prompts(prompts: list[torch.Tensor], shared: list[int], lengths: list[int]) -> dict:
    """Each answer's keys in two parts (vlft.forward.prefix_attention): the prefix it shares with
    the answers beside it (their prompt, or their image's prefix), read once for all of them, and
    its own keys, the rest of its prompt and then its own tokens."""
    prefixes, prefix_queries, own_prompt, own_index, own_lengths = [], [], [], [], []
    own_prompt_tokens = sum(len(p) - n for p, n in zip(prompts, shared))
    at, row = 0, 0  # where the next answer's own prompt keys go among all answers', and its tokens
    for prompt, prefix, length in zip(prompts, shared, lengths):
        if prefixes and int(prefixes[-1][0]) == int(prompt[0]) and len(prefixes[-1]) == prefix:
            prefix_queries[-1] += length  # the answer beside the one before, on the same prefix
        else:
            prefixes.append(prompt[:prefix])
            prefix_queries.append(length)
        own = prompt[prefix:]
        own_prompt.append(own)
        own_index += [torch.arange(at, at + len(own)), torch.arange(row, row + length) + own_prompt_tokens]
        own_lengths.append(len(own) + length)
        at, row = at + len(own), row + length
    return {
        "packed_prefix_index": torch.cat(prefixes),
        "packed_prefix_cu_seqlens_q": _cumulative(prefix_queries, "cpu"),
        "packed_prefix_cu_seqlens_k": _cumulative([len(p) for p in prefixes], "cpu"),
        "packed_prefix_max_seqlen_q": max(prefix_queries),
        "packed_prefix_max_seqlen_k": max(len(p) for p in prefixes),
        "packed_own_prompt_index": torch.cat(own_prompt),
        "packed_key_index": torch.cat(own_index),
        "packed_cu_seqlens_k": _cumulative(own_lengths, "cpu"),
        "packed_max_seqlen_k": max(own_lengths),
    }


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Several prefills' keys (or values) end to end; one prefill's as they are."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=2)


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    return host_to_device(torch.tensor([0] + lengths).cumsum(0, dtype=torch.int32), device)


@contextmanager
def _training(model):
    """The model in training mode (as the update's forward runs), its mode before put back after;
    nothing switched where it is in training mode already (the rollout keeps it there where its
    eval mode would compute the same: vlft.training.grpo)."""
    was = model.training
    if was:
        yield
        return
    model.train()
    try:
        yield
    finally:
        model.train(was)
