//! [`topological_order`]: the order in which `backward` runs a graph's nodes, written for any
//! graph of keyed nodes.

use std::collections::HashSet;
use std::hash::Hash;

/// The nodes reachable from `root`, each before every node it consumes (`root` first): the
/// reverse of the post-order of a depth-first walk.
///
/// `parents(node)` lists a node's parents in the op's order; the walk pushes them in that
/// order, so it explores the *last* parent first, and `key` identifies a node (a node
/// reached twice is visited once). The walk keeps an explicit stack, so a chain of 10,000
/// ops does not touch the call stack. This order decides when each gradient is made and
/// freed during backward, which is why the memory plan must follow it to the event.
///
/// ```
/// use tl_tensor::topological_order;
/// // d = f(b, c), b = g(a), c = h(a): a is consumed by b and c, so it comes after both.
/// let parents = |node: &char| match node {
///     'd' => vec!['b', 'c'],
///     'b' | 'c' => vec!['a'],
///     _ => vec![],
/// };
/// assert_eq!(topological_order('d', |n| *n, parents), ['d', 'b', 'c', 'a']);
/// ```
pub fn topological_order<N, K>(
    root: N,
    key: impl Fn(&N) -> K,
    mut parents: impl FnMut(&N) -> Vec<N>,
) -> Vec<N>
where
    N: Clone,
    K: Hash + Eq,
{
    let mut post_order = Vec::new();
    let mut visited = HashSet::new();
    // (node, parents pushed?)
    let mut stack = vec![(root, false)];
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            post_order.push(node);
            continue;
        }
        if !visited.insert(key(&node)) {
            continue;
        }
        stack.push((node.clone(), true));
        for parent in parents(&node) {
            if !visited.contains(&key(&parent)) {
                stack.push((parent, false));
            }
        }
    }
    post_order.reverse();
    post_order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_chain_is_ordered_without_recursion() {
        let order = topological_order(
            100_000u32,
            |n| *n,
            |&n| match n {
                0 => vec![],
                n => vec![n - 1],
            },
        );
        assert_eq!(order.len(), 100_001);
        assert!(order.windows(2).all(|w| w[0] == w[1] + 1));
    }

    #[test]
    fn the_last_parent_is_explored_first() {
        // e = f(a, b): b's branch (b, then a) is walked first, so in reverse post-order the
        // first parent a is the last node and b comes before it.
        let parents = |node: &char| match node {
            'e' => vec!['a', 'b'],
            'b' => vec!['a'],
            _ => vec![],
        };
        assert_eq!(topological_order('e', |n| *n, parents), ['e', 'b', 'a']);
    }
}
