"""Generated click logs: impressions of items shown to users, and whether each was clicked.

Offline and deterministic by `data.seed`, generated chunk by chunk (like `synthetic`), so
100M+ rows stream through ingest in bounded memory: only the per-user and per-item
parameters are held whole (about 40 bytes per user and per item).

What makes it realistic enough to judge a recommender by:
- Power-law frequencies: users and items are drawn from Zipf distributions (a few heavy
  users and hit items, a long tail seen a handful of times), each item's category from
  another; the most frequent ids are scattered over the id range, not 0, 1, 2, ...
- Planted structure: every user and item has a latent vector (an item's leans towards
  its category's), and the click probability is
      sigmoid(BASE + STRENGTH * <user, item> + item_bias + position, hour and price effects)
  The dense effects and the item bias are additive, so logistic regression on one-hot
  ids and dense features can learn them, and item popularity learns the bias; only a
  model that learns user x item (or user x category) interactions, such as dlrm's dot
  products, can learn the rest.

Columns: user_id, item_id, category (ids, exact integers in float32 features), then
hour (0..23), position (1..10, the slot the item was shown in), price; label 1 = click.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from training.data.options import DataConfig

ID_COLUMNS = ("user_id", "item_id", "category")
DENSE_COLUMNS = ("hour", "position", "price")
COLUMNS = ID_COLUMNS + DENSE_COLUMNS
# Rows per generated chunk: fixed, so the rows never depend on batch settings.
CHUNK_ROWS = 65536
LATENT_DIM = 8
ITEMS_PER_CATEGORY = 25
USER_ZIPF = 1.05  # exponents of the power laws (1: frequency ~ 1 / rank)
ITEM_ZIPF = 1.1
CATEGORY_ZIPF = 0.8
# The click model: a base rate of about 10 %, a strong planted interaction.
BASE_LOGIT = -2.6
STRENGTH = 1.5
ITEM_BIAS_STD = 0.5
POSITION_EFFECT = -0.15  # per slot further down the list
HOUR_EFFECT = 0.4  # amplitude of a daily cycle
PRICE_EFFECT = -0.4  # per unit of log price above the median


def num_categories(items: int) -> int:
    return max(2, items // ITEMS_PER_CATEGORY)


def _zipf_cdf(n: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def _draw(cdf: np.ndarray, order: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Ids by rank frequency: rank r (0 most frequent) is id order[r]."""
    ranks = np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)
    return order[ranks]


@dataclass(frozen=True)
class ClickWorld:
    """Everything fixed per seed: who likes what, and how often each id appears."""

    user_cdf: np.ndarray
    user_order: np.ndarray
    item_cdf: np.ndarray
    item_order: np.ndarray
    item_category: np.ndarray
    user_vectors: np.ndarray  # (users, LATENT_DIM) float32
    item_vectors: np.ndarray  # (items, LATENT_DIM) float32
    item_bias: np.ndarray
    item_log_price: np.ndarray

    @classmethod
    def make(cls, seed: int, users: int, items: int) -> ClickWorld:
        rng = np.random.default_rng([seed, 0xC11C])
        categories = num_categories(items)
        category_cdf = _zipf_cdf(categories, CATEGORY_ZIPF)
        item_category = _draw(category_cdf, rng.permutation(categories), rng.random(items))
        centres = rng.standard_normal((categories, LATENT_DIM))
        # An item is its category's centre plus its own variation, scaled so that
        # <user, item> has about unit variance.
        items_latent = (centres[item_category] + rng.standard_normal((items, LATENT_DIM))) / 2**0.5
        users_latent = rng.standard_normal((users, LATENT_DIM)) / LATENT_DIM**0.5
        return cls(
            user_cdf=_zipf_cdf(users, USER_ZIPF),
            user_order=rng.permutation(users),
            item_cdf=_zipf_cdf(items, ITEM_ZIPF),
            item_order=rng.permutation(items),
            item_category=item_category,
            user_vectors=users_latent.astype(np.float32),
            item_vectors=items_latent.astype(np.float32),
            item_bias=(rng.standard_normal(items) * ITEM_BIAS_STD).astype(np.float32),
            item_log_price=(3.0 + 0.8 * rng.standard_normal(items)).astype(np.float32),
        )

    def click_logit(
        self, user: np.ndarray, item: np.ndarray, hour: np.ndarray, position: np.ndarray
    ) -> np.ndarray:
        """The planted log-odds of a click (what a perfect model would predict)."""
        affinity = np.einsum("nd,nd->n", self.user_vectors[user], self.item_vectors[item])
        daily = HOUR_EFFECT * np.sin(2 * np.pi * hour / 24.0)
        return (
            BASE_LOGIT
            + STRENGTH * affinity
            + self.item_bias[item]
            + POSITION_EFFECT * (position - 1)
            + daily
            + PRICE_EFFECT * (self.item_log_price[item] - 3.0)
        )

    def rows(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n impressions: features (n, 6) float32 and clicks (n,) int64."""
        user = _draw(self.user_cdf, self.user_order, rng.random(n))
        item = _draw(self.item_cdf, self.item_order, rng.random(n))
        hour = rng.integers(0, 24, n).astype(np.float64)
        position = rng.integers(1, 11, n).astype(np.float64)
        logit = self.click_logit(user, item, hour, position)
        clicks = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
        price = np.exp(self.item_log_price[item]).round(2)
        columns = (user, item, self.item_category[item], hour, position, price)
        return np.stack(columns, axis=1).astype(np.float32), clicks


def click_batches(cfg: DataConfig) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(first row, features, clicks) of `data.clicks_rows` impressions of
    `data.clicks_users` users and `data.clicks_items` items, CHUNK_ROWS at a time; chunk
    i depends only on (seed, i). training.data.sources makes them tables."""
    world = ClickWorld.make(cfg.seed, cfg.clicks_users, cfg.clicks_items)
    for first in range(0, cfg.clicks_rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, cfg.clicks_rows - first)
        # Always a whole chunk's draws, cut after: fewer rows are a prefix of more rows.
        rng = np.random.default_rng([cfg.seed, 1, first // CHUNK_ROWS])
        features, clicks = world.rows(rng, CHUNK_ROWS)
        yield first, features[:n], clicks[:n]
