// Fused optimizer updates: one pass over memory each. Runtime scalars are arguments, in the
// compute type (float for half and float arrays, double for double).
#include "common.cuh"

// Delay-compensated ASGD (Zheng et al. 2017):
//   w <- w - lr * (g + lam * g*g*(w - w_bak)),   and w_bak <- w (new) when refresh != 0.
template <typename T>
__global__ void dcasgd(T* __restrict__ w, const T* __restrict__ g, T* __restrict__ w_bak,
                       typename compute<T>::type lr, typename compute<T>::type lam, int refresh, long long n) {
    typedef typename compute<T>::type C;
    MPICOLL_FOR_EACH(i, n) {
        C wi = load<T>(w[i]), gi = load<T>(g[i]);
        C updated = wi - lr * (gi + lam * gi * gi * (wi - load<T>(w_bak[i])));
        w[i] = store<T>(updated);
        if (refresh) w_bak[i] = store<T>(updated);
    }
}

// DC-ASGD-a: m <- beta*m + (1-beta)*g*g;  lam_t = lam0 / sqrt(m + eps); then the DC-ASGD step.
template <typename T>
__global__ void dcasgd_adaptive(T* __restrict__ w, const T* __restrict__ g, T* __restrict__ w_bak,
                                T* __restrict__ m, typename compute<T>::type lr, typename compute<T>::type lam0,
                                typename compute<T>::type beta, typename compute<T>::type eps,
                                int refresh, long long n) {
    typedef typename compute<T>::type C;
    MPICOLL_FOR_EACH(i, n) {
        C wi = load<T>(w[i]), gi = load<T>(g[i]);
        C mi = beta * load<T>(m[i]) + ((C)1 - beta) * gi * gi;
        C lam = lam0 / sqrt(mi + eps);
        C updated = wi - lr * (gi + lam * gi * gi * (wi - load<T>(w_bak[i])));
        m[i] = store<T>(mi);
        w[i] = store<T>(updated);
        if (refresh) w_bak[i] = store<T>(updated);
    }
}

// Plain SGD with a staleness-scaled rate: w <- w - (lr / tau) * g.
template <typename T>
__global__ void sgd(T* __restrict__ w, const T* __restrict__ g, typename compute<T>::type lr,
                    typename compute<T>::type tau, long long n) {
    typedef typename compute<T>::type C;
    C rate = lr / tau;
    MPICOLL_FOR_EACH(i, n) { w[i] = store<T>(load<T>(w[i]) - rate * load<T>(g[i])); }
}

// Adagrad (Downpour's server rule): h <- h + g*g;  w <- w - lr * g / (sqrt(h) + eps).
template <typename T>
__global__ void adagrad(T* __restrict__ w, const T* __restrict__ g, T* __restrict__ h,
                        typename compute<T>::type lr, typename compute<T>::type eps, long long n) {
    typedef typename compute<T>::type C;
    MPICOLL_FOR_EACH(i, n) {
        C gi = load<T>(g[i]);
        C hi = load<T>(h[i]) + gi * gi;
        h[i] = store<T>(hi);
        w[i] = store<T>(load<T>(w[i]) - lr * gi / (sqrt(hi) + eps));
    }
}

// Push-sum mixing: x <- a*x + b*y (parameters and the push-sum weight alike).
template <typename T>
__global__ void scaled_accumulate(T* __restrict__ x, const T* __restrict__ y, typename compute<T>::type a,
                                  typename compute<T>::type b, long long n) {
    typedef typename compute<T>::type C;
    MPICOLL_FOR_EACH(i, n) { x[i] = store<T>(a * load<T>(x[i]) + b * load<T>(y[i])); }
}

#define MPICOLL_OPTIM(T, C) \
    template __global__ void dcasgd<T>(T*, const T*, T*, C, C, int, long long); \
    template __global__ void dcasgd_adaptive<T>(T*, const T*, T*, T*, C, C, C, C, int, long long); \
    template __global__ void sgd<T>(T*, const T*, C, C, long long); \
    template __global__ void adagrad<T>(T*, const T*, T*, C, C, long long); \
    template __global__ void scaled_accumulate<T>(T*, const T*, C, C, long long);
MPICOLL_OPTIM(__half, float)
MPICOLL_OPTIM(float, float)
MPICOLL_OPTIM(double, double)
