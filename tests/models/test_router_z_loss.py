"""ST-MoE's router z-loss in the decoder: the mean over MoE layers and real positions of
``logsumexp(router logits)^2`` (Zoph et al., 2022, eq. 5), against float64 numpy from the
router inputs the forward captured; padding positions do not count."""

import numpy as np
from flax import nnx

from jaxrl.models import Decoder

from test_routing_replay import CONFIG, inputs


def test_router_z_loss_is_the_mean_squared_log_partition_over_moe_layers_and_real_positions():
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    ids, positions = inputs()
    segment_ids = np.ones_like(ids)
    segment_ids[0, 5:] = 0  # padding: out of the mean
    out = model(ids, positions, segment_ids, capture=True)
    act = {k: np.asarray(v) for k, v in out.activations.items()}
    per_layer = []
    for i, kind in enumerate(CONFIG.mlp_types):
        if kind != "moe":
            continue
        residual = act["embed"] if i == 0 else act[f"layers.{i - 1}.out"]
        router_in = np.asarray(model.layers[i].post_attention_norm(residual + act[f"layers.{i}.attn"]), np.float64)
        logits = router_in @ np.asarray(model.layers[i].mlp.router[...], np.float64)
        top = logits.max(axis=-1)
        log_partition = top + np.log(np.exp(logits - top[..., None]).sum(axis=-1))
        per_layer.append((log_partition ** 2)[segment_ids > 0].mean())
    np.testing.assert_allclose(float(out.router_z_loss), np.mean(per_layer), rtol=1e-5)
