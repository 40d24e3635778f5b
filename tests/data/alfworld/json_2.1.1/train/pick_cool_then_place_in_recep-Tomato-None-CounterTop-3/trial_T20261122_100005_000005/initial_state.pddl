(define (problem plan_trial_T20261122_100005_000005)
    (:domain alfred)
    (:objects
        agent1 - agent
        TomatoType - otype
        DiningTableType - rtype
        FridgeType - rtype
        CounterTopType - rtype
        Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40 - object
        DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_44 - receptacle
        Fridge_bar__minus_02_dot_10_bar__plus_00_dot_00_bar__plus_01_dot_07 - receptacle
        CounterTop_bar__minus_01_dot_87_bar__plus_00_dot_95_bar__minus_01_dot_21 - receptacle
        loc_bar_4_bar_2_bar_1_bar_60 - location
        loc_bar__minus_5_bar_4_bar_3_bar_15 - location
        loc_bar__minus_5_bar__minus_5_bar_3_bar_45 - location
        loc_bar_0_bar_0_bar_2_bar_30 - location
        )
    (:init
        (receptacleType DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_44 DiningTableType)
        (receptacleType Fridge_bar__minus_02_dot_10_bar__plus_00_dot_00_bar__plus_01_dot_07 FridgeType)
        (receptacleType CounterTop_bar__minus_01_dot_87_bar__plus_00_dot_95_bar__minus_01_dot_21 CounterTopType)
        (objectType Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40 TomatoType)
        (canContain DiningTableType TomatoType)
        (canContain FridgeType TomatoType)
        (canContain CounterTopType TomatoType)
        (openable Fridge_bar__minus_02_dot_10_bar__plus_00_dot_00_bar__plus_01_dot_07)
        (pickupable Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40)
        (cleanable Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40)
        (heatable Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40)
        (coolable Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40)
        (sliceable Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40)
        (atLocation agent1 loc_bar_0_bar_0_bar_2_bar_30)
        (receptacleAtLocation DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_44 loc_bar_4_bar_2_bar_1_bar_60)
        (receptacleAtLocation Fridge_bar__minus_02_dot_10_bar__plus_00_dot_00_bar__plus_01_dot_07 loc_bar__minus_5_bar_4_bar_3_bar_15)
        (receptacleAtLocation CounterTop_bar__minus_01_dot_87_bar__plus_00_dot_95_bar__minus_01_dot_21 loc_bar__minus_5_bar__minus_5_bar_3_bar_45)
        (inReceptacle Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40 DiningTable_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_00_dot_44)
        (objectAtLocation Tomato_bar__plus_01_dot_19_bar__plus_00_dot_81_bar__plus_00_dot_40 loc_bar_4_bar_2_bar_1_bar_60)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (coolable ?o)
                        (objectType ?o TomatoType)
                        (receptacleType ?r CounterTopType)
                        (isCool ?o)
                        (inReceptacle ?o ?r)
                    )
                )
            )
        )
    )
)
