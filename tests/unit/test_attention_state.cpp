#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "test_seed.hpp"
#include "writescope/core/attention_state.hpp"

using namespace writescope;

namespace {

// Exact (fp64) partial state of scores s[i] with values v[i][:] over index set [b, e).
void ref_state(const std::vector<double>& s, const std::vector<std::vector<double>>& v,
               std::size_t b, std::size_t e, std::vector<float>& o, float& lse) {
    const std::size_t dim = v.empty() ? 0 : v[0].size();
    o.assign(dim, 0.0f);
    if (b == e) {
        lse = kLseEmpty;
        return;
    }
    double m = -INFINITY;
    for (std::size_t i = b; i < e; ++i)
        m = std::max(m, s[i]);
    double z = 0;
    std::vector<double> acc(dim, 0.0);
    for (std::size_t i = b; i < e; ++i) {
        const double w = std::exp(s[i] - m);
        z += w;
        for (std::size_t d = 0; d < dim; ++d)
            acc[d] += w * v[i][d];
    }
    for (std::size_t d = 0; d < dim; ++d)
        o[d] = static_cast<float>(acc[d] / z);
    lse = static_cast<float>(m + std::log(z));
}

}  // namespace

TEST_CASE("merging partial states at random split points equals unsplit attention",
          "[unit][merge]") {
    auto rng = test::seeded_rng("merge split");
    std::normal_distribution<double> nd(0.0, 3.0);
    for (int trial = 0; trial < 200; ++trial) {
        const std::size_t n = 1 + rng() % 300, dim = 1 + rng() % 64;
        std::vector<double> s(n);
        std::vector<std::vector<double>> v(n, std::vector<double>(dim));
        for (auto& x : s)
            x = nd(rng);
        for (auto& row : v)
            for (auto& x : row)
                x = nd(rng);
        std::vector<float> o_full;
        float lse_full;
        ref_state(s, v, 0, n, o_full, lse_full);

        // Cut into up to 6 parts (some empty), merge them pairwise in random order and N-way.
        std::vector<std::size_t> cuts{0, n};
        for (int c = 0, k = static_cast<int>(rng() % 6); c < k; ++c)
            cuts.push_back(rng() % (n + 1));
        std::sort(cuts.begin(), cuts.end());
        std::vector<std::vector<float>> po(cuts.size() - 1);
        std::vector<float> pl(cuts.size() - 1);
        for (std::size_t p = 0; p + 1 < cuts.size(); ++p)
            ref_state(s, v, cuts[p], cuts[p + 1], po[p], pl[p]);

        std::vector<std::size_t> order(po.size());
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<float> acc(dim, 0.0f);
        float acc_lse = kLseEmpty;
        for (auto p : order)
            merge_state_into(acc.data(), acc_lse, po[p].data(), pl[p], dim);

        std::vector<ConstStateView> views;
        for (std::size_t p = 0; p < po.size(); ++p)
            views.push_back({po[p].data(), &pl[p], 1, dim});
        std::vector<float> nway(dim);
        float nway_lse;
        merge_states(views, {nway.data(), &nway_lse, 1, dim});

        double scale = 0;
        for (float x : o_full)
            scale = std::max(scale, std::fabs(static_cast<double>(x)));
        for (std::size_t d = 0; d < dim; ++d) {
            REQUIRE(std::fabs(acc[d] - o_full[d]) <= 1e-5 * (scale + 1));
            REQUIRE(std::fabs(nway[d] - o_full[d]) <= 1e-5 * (scale + 1));
        }
        REQUIRE(std::fabs(acc_lse - lse_full) <= 1e-5 * (std::fabs(lse_full) + 1));
        REQUIRE(std::fabs(nway_lse - lse_full) <= 1e-5 * (std::fabs(lse_full) + 1));
    }
}

TEST_CASE("empty parts are NaN-safe in the merge", "[unit][merge]") {
    std::vector<float> a(4, 0.0f), b(4, 0.0f);
    float la = kLseEmpty, lb = kLseEmpty;
    merge_state_into(a.data(), la, b.data(), lb, 4);
    CHECK(la == kLseEmpty);
    for (float x : a)
        CHECK(x == 0.0f);

    std::vector<float> c{1, 2, 3, 4};
    float lc = 0.5f;
    merge_state_into(a.data(), la, c.data(), lc, 4);
    CHECK(la == 0.5f);
    CHECK(a == c);
    merge_state_into(a.data(), la, b.data(), kLseEmpty, 4);
    CHECK(a == c);

    std::vector<ConstStateView> none{{b.data(), &lb, 1, 4}, {b.data(), &lb, 1, 4}};
    std::vector<float> out(4, 7.0f);
    float lout = 1.0f;
    merge_states(none, {out.data(), &lout, 1, 4});
    CHECK(lout == kLseEmpty);
    for (float x : out)
        CHECK(x == 0.0f);
}
